"""The bearer token of a TCP control listener (docs/design.md "Control protocol"), read from the
environment by its server and its clients alike; never logged or written anywhere."""

from __future__ import annotations

import os
from collections.abc import Mapping

from lossguard.common.control.protocol import MIN_TOKEN_LENGTH

DEFAULT_TOKEN_ENV = "LOSSGUARD_CONTROL_TOKEN"


def token_from_env(name: str, environ: Mapping[str, str] = os.environ) -> str:
    """The bearer token in the environment variable ``name``; ValueError (one line, without
    the token) when it is unset, empty or shorter than MIN_TOKEN_LENGTH."""
    token = environ.get(name, "")
    if not token:
        raise ValueError(f"needs a token in the environment variable {name}, which is not set")
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"the token in {name} has {len(token)} characters, fewer than {MIN_TOKEN_LENGTH}: "
            "make one with openssl rand -hex 32"
        )
    return token
