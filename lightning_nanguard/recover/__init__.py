"""recover"""
