"""What the public Agent, Peer and Region point at: the agent's state (``core``), its registered
memory (``regions``), connecting (``connect``) and a peer's links and control session (``peer_core``)."""
