"""libmobile_moe, the runtime an app links: its C/C++ sources (libmobile_moe/: the public header in include/, the
library in src/, its clients in runner/, examples/, java/ and tests/), their build against the executorch wheel
(build.py), and the SDK folder an app ships (sdk.py, `mobile-moe sdk`)."""
