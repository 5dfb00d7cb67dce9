"""Small helpers that several rooms need, each defined once: files, processes, addresses."""
