"""Pure module transforms ``(module, mesh or group, options) -> module``; no Lightning, no Hydra."""
