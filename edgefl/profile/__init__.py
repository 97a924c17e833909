"""Device profiles: the schema, the shipped catalog (``firmware_profiles/``) and loading."""

from edgefl.profile.schema import DeviceProfile, Quantity, catalog, load_profile

__all__ = ["DeviceProfile", "Quantity", "catalog", "load_profile"]
