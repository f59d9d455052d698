from __future__ import annotations

import os

# Each test process and its children share 2 cores: one intra-op thread each keeps gloo tests from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
