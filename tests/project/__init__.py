"""The repository beside the code: the docs say what is true, deploy/ renders and validates, the image check,
the generated protos, the packages' layers."""
