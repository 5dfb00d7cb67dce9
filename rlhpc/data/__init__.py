"""Data on the driver: built-in tasks and user data files, the prompt order (a pure function of
seed and rollout id), row -> prompt token ids, and dynamic sampling's group filters."""
