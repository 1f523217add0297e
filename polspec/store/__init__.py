"""The results database: schema (``schema``), engine set-up (``engine``) and migrations (``migrate``)."""
