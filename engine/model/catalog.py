"""The catalog, as the engine names it: the lookup itself is `charllm.probes.core.catalog` (the simulator,
below the engine, reads its hardware presets there too); these are its functions, not a copy."""

from charllm.probes.core.catalog import (
    ALIASES,
    KINDS,
    PRESET_NAME,
    SINGULAR,
    entries,
    find,
    is_user,
    new_user_preset,
    read,
    resolve,
    suggestion,
)

__all__ = ["ALIASES", "KINDS", "PRESET_NAME", "SINGULAR", "entries", "find", "is_user", "new_user_preset", "read",
           "resolve", "suggestion"]
