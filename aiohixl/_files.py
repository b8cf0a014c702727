"""Reading the small text files the kernel and the system keep (sysfs, /proc, /etc)."""


def read_text(path: str) -> str:
    """The file's stripped content, or "" when it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
