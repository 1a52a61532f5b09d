"""The router's warnings about how the config holds API keys: plain key text,
a world-readable file; never the key itself in the warning."""

from __future__ import annotations

import os

from stackutil import write_config

from shared.config import load
from shared.keys import secret_warnings

KEY_Q = "sk-test-quota-7d1f0c2b9e"


def test_plain_keys_and_world_readable_secrets_are_warned_about(tmp_path):
    path = write_config(tmp_path, api_keys=[{"key": KEY_Q, "tenant": "q"}])
    os.chmod(path, 0o644)
    warnings = secret_warnings(load(path), str(path))
    assert len(warnings) == 2 and "plain text" in warnings[0] and "world-readable" in warnings[1]
    assert not any(KEY_Q in w for w in warnings)
    os.chmod(path, 0o600)
    assert len(secret_warnings(load(path), str(path))) == 1
