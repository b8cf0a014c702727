"""The control plane: framing (``wire``), handshake and identities (``handshake``), the session
after it (``session``) and the listening side (``listener``)."""
