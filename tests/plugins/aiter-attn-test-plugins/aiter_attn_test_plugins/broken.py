"""A plugin whose import fails (a missing vendor library)."""

import aiter_attn_vendor_library_that_does_not_exist  # noqa: F401
