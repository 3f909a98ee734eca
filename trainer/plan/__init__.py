"""The RunSpec: the composed config turned once into checked, typed values (no torch)."""
