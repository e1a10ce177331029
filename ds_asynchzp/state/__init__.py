"""Buffers only, no collectives: the parameter and gradient shards, the gather pool and staging rings, each flow's
scratch, the error-feedback residual, and the fingerprints of the own parameter rows."""
