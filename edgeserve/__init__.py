"""edgeserve: the composition root (CLI, paths) and the small vocabulary every room shares."""
