"""Any nn.Module as a pipeline: captured with torch.export, cut into pieces, built without its weights."""
