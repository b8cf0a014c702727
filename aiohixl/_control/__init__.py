"""The control plane: framing (``wire``), handshake, identities and sessions (``handshake``) and
the listening side (``listener``)."""
