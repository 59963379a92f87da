"""What people ask of a code interpreter, through the installed function, in the sandbox environment.

Each request is one run in one chat (in-process function, real storage, real gVisor on the sandbox
environment that scripts/setup builds). Each one does its job: it writes a real file that is then read
back by another library, or prints a result the test checks, never just an import.
"""

from __future__ import annotations

import pytest
import pytest_asyncio

from tests.support.pipe_harness import PipeHarness, code

# One chat for all the requests, as a user would make them, so one event loop for the module.
pytestmark = [pytest.mark.runsc, pytest.mark.asyncio(loop_scope="module")]

USER, CHAT = "alice", "chat-env"

REQUESTS: dict[str, tuple[str, str, str]] = {
    # name: (language, code, what the answer must contain)
    "word document": (
        "python",
        "from docx import Document\n"
        "doc = Document(); doc.add_heading('Quarterly report', 1)\n"
        "doc.add_paragraph('Revenue grew by 12%.')\n"
        "t = doc.add_table(rows=2, cols=2); t.cell(0, 0).text = 'Q1'; t.cell(1, 1).text = '42'\n"
        "doc.save('/mnt/data/report.docx')\n"
        "back = Document('/mnt/data/report.docx')\n"
        "print('docx', [p.text for p in back.paragraphs], back.tables[0].cell(1, 1).text)",
        "docx ['Quarterly report', 'Revenue grew by 12%.'] 42",
    ),
    "powerpoint deck": (
        "python",
        "from pptx import Presentation\n"
        "deck = Presentation()\n"
        "for title in ('Intro', 'Results', 'Next steps'):\n"
        "    slide = deck.slides.add_slide(deck.slide_layouts[1]); slide.shapes.title.text = title\n"
        "deck.save('/mnt/data/deck.pptx')\n"
        "print('slides', [s.shapes.title.text for s in Presentation('/mnt/data/deck.pptx').slides])",
        "slides ['Intro', 'Results', 'Next steps']",
    ),
    "excel with a formula, read back": (
        "python",
        "import xlsxwriter, openpyxl, pandas as pd\n"
        "wb = xlsxwriter.Workbook('/mnt/data/sales.xlsx'); ws = wb.add_worksheet('sales')\n"
        "ws.write_row(0, 0, ['item', 'qty']); ws.write_row(1, 0, ['pen', 3])\n"
        "ws.write_row(2, 0, ['ink', 4])\n"
        "ws.write_formula(3, 1, '=SUM(B2:B3)'); wb.close()\n"
        "print('formula', openpyxl.load_workbook('/mnt/data/sales.xlsx')['sales']['B4'].value)\n"
        "print('pandas', pd.read_excel('/mnt/data/sales.xlsx').qty.iloc[:2].sum())",
        "formula =SUM(B2:B3)",
    ),
    "pdf written, then read": (
        "python",
        "from reportlab.lib.pagesizes import A4\nfrom reportlab.pdfgen import canvas\n"
        "c = canvas.Canvas('/mnt/data/invoice.pdf', pagesize=A4)\n"
        "c.drawString(72, 760, 'Invoice 2026-117: total 99.50 EUR'); c.showPage(); c.save()\n"
        "import pypdf, pdfplumber\n"
        "print('pypdf', pypdf.PdfReader('/mnt/data/invoice.pdf').pages[0].extract_text().strip())\n"
        "with pdfplumber.open('/mnt/data/invoice.pdf') as pdf:\n"
        "    print('plumber', 'total 99.50' in pdf.pages[0].extract_text())",
        "pypdf Invoice 2026-117: total 99.50 EUR",
    ),
    "seaborn chart": (
        "python",
        "import seaborn as sns, pandas as pd, matplotlib.pyplot as plt\n"
        "df = pd.DataFrame({'x': range(20), 'y': [v * v for v in range(20)]})\n"
        "ax = sns.lineplot(data=df, x='x', y='y')\n"
        "ax.figure.savefig('/mnt/data/trend.png'); plt.close('all')\n"
        "print('png', open('/mnt/data/trend.png', 'rb').read(4) == b'\\x89PNG')",
        "png True",
    ),
    "interactive chart, offline html": (
        "python",
        "import plotly.express as px\n"
        "fig = px.bar(x=['a', 'b', 'c'], y=[3, 1, 2], title='offline')\n"
        "fig.write_html('/mnt/data/chart.html', include_plotlyjs=True)\n"
        "html = open('/mnt/data/chart.html').read()\n"
        # No <script src="http...">: plotly.js is inside the file (its own code names map icons' URLs).
        "print('html', len(html) > 1_000_000, '<script src=\"http' not in html, 'Plotly.newPlot' in html)",
        "html True True True",
    ),
    "machine learning": (
        "python",
        "from sklearn.datasets import load_iris\nfrom sklearn.model_selection import train_test_split\n"
        "from sklearn.ensemble import RandomForestClassifier\n"
        "X, y = load_iris(return_X_y=True)\n"
        "Xa, Xb, ya, yb = train_test_split(X, y, random_state=0)\n"
        "print('accuracy', RandomForestClassifier(random_state=0).fit(Xa, ya).score(Xb, yb) > 0.9)",
        "accuracy True",
    ),
    "parallel work": (
        "python",
        "import multiprocessing as mp\nfrom joblib import Parallel, delayed\n"
        "with mp.Pool(2) as pool:\n    print('pool', pool.map(abs, [-1, -2, -3]))\n"
        "print('joblib', Parallel(n_jobs=2)(delayed(pow)(i, 2) for i in range(4)))",
        "pool [1, 2, 3]",
    ),
    "regression and statistics": (
        "python",
        "import numpy as np, statsmodels.api as sm, scipy.stats as st\n"
        "x = np.arange(50.0); y = 2 * x + 1 + np.random.default_rng(0).normal(0, 0.1, 50)\n"
        "fit = sm.OLS(y, sm.add_constant(x)).fit()\n"
        "print('slope', round(fit.params[1], 2), 'p<0.05', st.ttest_1samp(y, 0).pvalue < 0.05)",
        "slope 2.0 p<0.05 True",
    ),
    "symbolic maths and graphs": (
        "python",
        "import sympy as sp, networkx as nx\n"
        "x = sp.symbols('x'); print('roots', sorted(sp.solve(x**2 - 5*x + 6, x)))\n"
        "g = nx.Graph([('a', 'b'), ('b', 'c'), ('a', 'd'), ('d', 'c'), ('c', 'e')])\n"
        "print('path', len(nx.shortest_path(g, 'a', 'e')))",
        "roots [2, 3]",
    ),
    "data engines": (
        "python",
        "import polars as pl, duckdb, pandas as pd, pyarrow.parquet as pq\n"
        "df = pd.DataFrame({'city': ['a', 'b', 'a', 'c'], 'sales': [1, 2, 3, 4]})\n"
        "df.to_parquet('/mnt/data/sales.parquet')\n"
        "print('parquet rows', pq.read_table('/mnt/data/sales.parquet').num_rows)\n"
        "sums = pl.read_parquet('/mnt/data/sales.parquet').group_by('city').agg(pl.col('sales').sum())\n"
        "print('polars', sums.sort('city')['sales'].to_list())\n"
        "print('duckdb', duckdb.sql(\"select sum(sales) from '/mnt/data/sales.parquet' where city = 'a'\")"
        ".fetchall()[0][0])\n"
        "print('pandas', pd.__version__.split('.')[0] >= '2')",
        "polars [4, 2, 4]",
    ),
    "images": (
        "python",
        "from PIL import Image, ImageDraw\nimport cv2, numpy as np\n"
        "im = Image.new('RGB', (200, 120), 'white')\n"
        "ImageDraw.Draw(im).rectangle([40, 30, 160, 90], fill='black')\n"
        "im.save('/mnt/data/box.png'); im.thumbnail((50, 50)); im.save('/mnt/data/thumb.png')\n"
        "edges = cv2.Canny(cv2.imread('/mnt/data/box.png', cv2.IMREAD_GRAYSCALE), 50, 150)\n"
        "cv2.imwrite('/mnt/data/edges.png', edges)\n"
        "print('thumb', Image.open('/mnt/data/thumb.png').size, 'edges', int(np.count_nonzero(edges)) > 100)",
        "thumb (50, 30) edges True",
    ),
    "parsing html, markdown, yaml": (
        "python",
        "from bs4 import BeautifulSoup\nimport markdown, yaml, lxml.etree\n"
        "soup = BeautifulSoup('<table><tr><td>a</td><td>b</td></tr></table>', 'lxml')\n"
        "print('cells', [td.text for td in soup.find_all('td')])\n"
        "print('md', markdown.markdown('# Title\\n\\n*x*'))\n"
        "print('yaml', yaml.safe_load(yaml.safe_dump({'k': [1, 2]})))",
        "cells ['a', 'b']",
    ),
    "small tools": (
        "python",
        "import qrcode, tabulate\nfrom dateutil import parser\n"
        "qrcode.make('https://example.org').save('/mnt/data/qr.png')\n"
        "print('date', parser.parse('3 March 2026 14:05').isoformat())\n"
        "print(tabulate.tabulate([['pen', 3]], headers=['item', 'qty'], tablefmt='github'))",
        "date 2026-03-03T14:05:00",
    ),
    "the shell": (
        "bash",
        "cd /mnt/data && ls -la && stat -c '%s %n' report.docx\n"
        "zip -q bundle.zip report.docx deck.pptx && unzip -l bundle.zip | tail -1\n"
        "sqlite3 shop.db 'create table t(x); insert into t values (20), (22); select sum(x) from t;'\n"
        "file invoice.pdf | cut -d, -f1\n"
        'echo \'{"a": {"b": 7}}\' | jq .a.b\n'
        "pdftotext invoice.pdf - | head -1",
        "2 files",
    ),
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def harness(tmp_path_factory: pytest.TempPathFactory) -> PipeHarness:
    harness = PipeHarness(tmp_path_factory.mktemp("env") / "data", valves={"timeout_seconds": 60})
    yield harness
    await harness.aclose()


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_a_typical_request_does_its_job(harness: PipeHarness, name: str) -> None:
    language, source, expected = REQUESTS[name]
    answer = await harness.say(USER, CHAT, code(source, language=language))
    assert expected in answer, answer[-3000:]
    assert "Traceback" not in answer and "Error" not in answer, answer[-3000:]


async def test_the_shell_lists_files_and_every_output_exists(harness: PipeHarness) -> None:
    """After the requests above: the files they wrote are real files in the chat's folder."""
    listing = code("ls -la /mnt/data | tail -n +2 | wc -l; stat /mnt/data", language="bash")
    answer = await harness.say(USER, CHAT, listing)
    assert "Invalid argument" not in answer and "Access: (0700/drwx------)" in answer, answer
    folder = next(p for p in harness.sessions_root.rglob("report.docx")).parent
    for name in (
        "report.docx",
        "deck.pptx",
        "sales.xlsx",
        "invoice.pdf",
        "chart.html",
        "sales.parquet",
        "edges.png",
        "qr.png",
        "bundle.zip",
        "shop.db",
    ):
        path = folder / name
        assert path.is_file() and path.stat().st_size > 0, name
    assert (folder / "report.docx").read_bytes()[:2] == b"PK"
    assert (folder / "invoice.pdf").read_bytes()[:5] == b"%PDF-"


async def test_the_prompt_names_the_environment(harness: PipeHarness) -> None:
    system = harness.requests[-1]["messages"][0]["content"]
    for name in (
        "docx (python-docx)",
        "pptx (python-pptx)",
        "polars",
        "duckdb",
        "sklearn (scikit-learn)",
        "cv2 (opencv-python-headless)",
        "plotly",
    ):
        assert name in system, system
    assert "Command-line tools in bash" in system and "sqlite3" in system and "jq" in system
    # The notable packages, not all 170 asked for: a dependency-level tool is installed, not named.
    assert "toolz" not in system and "more (importlib.metadata.distributions() lists them all)" in system
    assert "ffmpeg" in system and "tesseract" in system and "pandoc" in system
