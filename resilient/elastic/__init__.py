"""Recovery policy and mechanisms: re-forming the process group in process, taking state from a peer."""
