# Invariant: DecodeError is the only exception that decoding untrusted bytes may raise; its message
# is a human-readable reason naming the field that was wrong.
"""The one error raised for bad encoded input."""


class DecodeError(ValueError):
    """Encoded bytes were malformed, truncated, over budget or inconsistent.

    Raised by every decoder in this package for any bad input; the message says what was wrong.
    A peer that sends bytes raising this has misbehaved (it is never our bug).
    """
