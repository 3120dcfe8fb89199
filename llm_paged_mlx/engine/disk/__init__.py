"""The disk tier of the prefix cache: full KV blocks kept as files across processes.

``format`` is a block file's bytes and checks, ``store`` one model's cache over a
directory (``KVDiskCache``), ``admin`` the directory as a whole, for any model.
"""
