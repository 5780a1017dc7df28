"""Model families, their loaders and the registry that maps config to class."""
