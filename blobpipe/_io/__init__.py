"""Input: the LMDB reader, the Datum codec, transforms and batches."""
