"""The clustering methods of `superclass derive --method`, named here without scikit-learn (clustering.py implements
them) so that `mobile-moe superclass --help` starts at once."""

METHOD_HELP = {
    "spectral": "spectral clustering of the confusion graph (the default)",
    "louvain": "Louvain communities of the graph's nearest neighbours, merged or split to exactly E",
    "balanced": "spectral embedding, then super-classes of equal size (within one class)",
}
METHODS = tuple(METHOD_HELP)
