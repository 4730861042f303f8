"""The node process: its service state and request schemas (the HTTP layer is gpu_node.server)."""
