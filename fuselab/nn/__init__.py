"""fuselab.nn"""
