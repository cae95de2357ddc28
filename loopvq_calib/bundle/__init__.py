"""The bundle format (docs/bundle-format.md): the writer, the validating reader, the model card and
publishing to the hub.
"""
