"""The hosts themselves: removed after a failure, and a killed run's leftovers swept."""

from __future__ import annotations

import subprocess

import netns
import pytest


def namespaces() -> set[str]:
    return {line.split()[0] for line in netns.ip("netns", "list").stdout.splitlines() if line.strip()}


def test_hosts_are_removed_when_the_body_fails():
    with pytest.raises(RuntimeError), netns.Hosts(2) as hosts:
        made = {hosts.switch, *(h.name for h in hosts.hosts)}
        assert made <= namespaces()
        raise RuntimeError("a failed test")
    assert not made & namespaces()
    assert hosts.tag not in netns.ip("-o", "link", "show").stdout


def test_a_dead_runs_namespaces_are_swept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"hx{dead.pid}x0h0"
    netns.ip("netns", "add", name)
    try:
        netns.sweep()
        assert name not in namespaces()
    finally:
        netns.ip("netns", "del", name, check=False)
