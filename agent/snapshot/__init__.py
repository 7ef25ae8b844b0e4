"""The snapshot on disk: the manifest and its protobuf form."""
