"""The ``torch`` collective: c10d's process group behind phalanx's
contract, its errors, backends, store and work handles, and the
one-device collective."""
