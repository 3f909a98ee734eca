"""Token datasets, the sample stream, and the slice of a global batch a rank keeps."""
