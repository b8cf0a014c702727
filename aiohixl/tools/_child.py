"""Helper processes of the tools, driven one line at a time."""

from __future__ import annotations

import subprocess
import sys


class LineChild:
    """A helper process answering one line per line we send; "exit" ends it."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.first = self.proc.stdout.readline().strip()
        if not self.first:
            raise RuntimeError(f"{' '.join(args)} did not start")

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        try:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
