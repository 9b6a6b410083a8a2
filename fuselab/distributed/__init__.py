"""fuselab.distributed"""
