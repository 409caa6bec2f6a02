"""Basic auth for the native stack's Prometheus and Alertmanager, as the compose stack sets it:
``deploy/web.yml`` rendered with the bcrypt hash of a password, for ``--web.config.file``."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt

from tests.support.processes import REPO

WEB_CONFIG = REPO / "deploy" / "web.yml"
HASH_MARKER = "@LOSSGUARD_WEB_PASSWORD_HASH@"
USER = "lossguard"


@dataclass(frozen=True)
class WebAuth:
    """The web user ``lossguard`` and its password."""

    password: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def pair(self) -> tuple[str, str]:
        """For ``requests``' ``auth=``."""
        return USER, self.password

    def web_config(self, path: Path) -> Path:
        """``deploy/web.yml`` with this password's hash, written owner-only to ``path``."""
        hashed = bcrypt.hashpw(self.password.encode(), bcrypt.gensalt(4)).decode()
        text = WEB_CONFIG.read_text()
        assert text.count(HASH_MARKER) == 1
        return _private(path, text.replace(HASH_MARKER, hashed))

    def password_file(self, path: Path) -> Path:
        """The password alone, owner-only, for Prometheus's ``basic_auth.password_file``."""
        return _private(path, self.password)


def _private(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path
