from .mesh import Mesh, init_mesh
