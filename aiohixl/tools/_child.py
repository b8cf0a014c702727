"""Helper processes of the tools, driven one line at a time."""

from __future__ import annotations

import subprocess
import sys


class LineChild:
    """A helper process answering one line per line we send; "exit" ends it."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.first = self.stdout.readline().strip()
        if not self.first:
            raise RuntimeError(f"{' '.join(args)} did not start")

    def ask(self, line: str) -> str:
        self.tell(line)
        return self.answer()

    def tell(self, line: str) -> None:
        """Send a line without waiting for the answer (``answer()`` reads it later)."""
        self.stdin.write(line + "\n")
        self.stdin.flush()

    def answer(self) -> str:
        return self.stdout.readline().strip()

    def close(self) -> None:
        try:
            self.stdin.write("exit\n")
            self.stdin.flush()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
