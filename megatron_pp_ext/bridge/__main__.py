"""``python -m megatron_pp_ext.bridge``: the launcher (:mod:`megatron_pp_ext.bridge.launch`)."""

from .launch import main

if __name__ == "__main__":
    main()
