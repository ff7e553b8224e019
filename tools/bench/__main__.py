"""`python -m tools.bench`: the same as `tritonllm bench`."""

from tools.bench.cli import main

raise SystemExit(main())
