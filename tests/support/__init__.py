"""Helpers shared by every test folder: free ports, managed processes, waits."""
