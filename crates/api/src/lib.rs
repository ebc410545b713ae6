//! Public HTTP types of the Runtime API (serde only; depends on no workspace crate).
