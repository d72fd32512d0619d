"""The gossip protocol, sans-I/O: membership, link estimates, partner choice, averaging rules."""
