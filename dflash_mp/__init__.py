"""dflash_mp: a multi-process trainer for DFlash speculative-decoding drafters."""
