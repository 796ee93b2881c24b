"""libmobile_moe, the runtime an app links: its C/C++ sources (the repository's libmobile_moe/, a component of its own
that the wheel carries here: the public header in include/, the library in src/, its clients in runner/, examples/,
java/ and tests/), their build against the executorch wheel (build.py), and the SDK folder an app ships (sdk.py,
`mobile-moe sdk`)."""
