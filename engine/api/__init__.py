"""The OpenAI wire types, API errors and request-to-engine parameter mapping that the server and the router share."""
