"""Job specs and their validation, the RQ job functions, datasets and sweep expansion.

Filled in by the job-system and evaluation issues; the decoder (``polspec.decoding``) and the
results database (``polspec.store``) it calls are in place.
"""
