"""fuselab.quant"""
