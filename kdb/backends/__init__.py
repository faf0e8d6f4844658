"""Back ends: each derives arch ids and compiler identities from a device and compiles."""
