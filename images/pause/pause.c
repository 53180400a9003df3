/* The pod sandbox's first process: holds the pod's namespaces open, reaps
 * zombies (it is PID 1 when the pod shares its PID namespace) and exits on
 * SIGINT/SIGTERM. Built statically (no libc needed in the image):
 *   cc -Os -static -o pause pause.c
 * e2e/localcluster/pause.py packs the binary into an image for containerd. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

static int install(int sig, void (*fn)(int)) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = fn;
  sa.sa_flags = SA_RESTART | (sig == SIGCHLD ? SA_NOCLDSTOP : 0);
  return sigaction(sig, &sa, NULL);
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("kvmesh pause 1");
    return 0;
  }
  if (getpid() != 1) fputs("pause: warning: not running as PID 1\n", stderr);
  if (install(SIGINT, on_stop) || install(SIGTERM, on_stop) || install(SIGCHLD, on_child)) {
    perror("pause: sigaction");
    return 1;
  }
  for (;;) pause();
}
