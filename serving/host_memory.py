"""Old home of the glibc malloc settings, now in `serving.jax_platform` (with the rest of the
process set-up). Kept only for `serving.runtime`, which still imports `keep_freed_memory` from
here; delete once it imports `serving.jax_platform`."""
from serving.jax_platform import keep_freed_memory  # noqa: F401
