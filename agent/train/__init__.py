"""The built-in trainer: a nanoGPT-style GPT, its data, optimizer, precision and fault drills,
driven through the same public Guard API a user's own loop uses."""
