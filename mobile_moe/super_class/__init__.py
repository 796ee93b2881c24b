"""Super-classes derived from a dense model's confusion graph (clustering, stability, listings), above training,
whose runs it reads. The super-class and confusion files themselves are mobile_moe.formats'."""
