"""A run on disk: the run folder and its one-process lock (folder), checkpoints written
atomically and verified before use (checkpoint), their manifests (manifest), and where a
checkpoint's weights came from (origin)."""
