"""The OpenAI-compatible HTTP surface as pure code: request models, error bodies, stop strings,
response shaping. The gateway service wires these to aiohttp and the bus."""
