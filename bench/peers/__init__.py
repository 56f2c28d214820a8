"""joader beside its peers: TensorSocket (one shared loader) and independent DataLoaders."""
